"""Twenty JSON schemas and prompts for the structured-output tests (tests/cluster/test_e2e.py): nested
objects, arrays with min/max items, enums, required and optional fields, bounded numbers,
strings with patterns, anyOf with null. Strings and arrays are bounded so that a reply ends
within max_tokens."""



def S(n: int = 16) -> dict:
    """A string of at most ``n`` characters."""
    return {"type": "string", "maxLength": n}


SCHEMAS = [
    {"type": "object", "properties": {"name": S(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": S(), "country": S()}, "required": ["city"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S(10), "minItems": 2, "maxItems": 4}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}, "currency": {"enum": ["USD", "EUR"]}}, "required": ["price", "currency"], "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": S(24)}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"first": S(), "last": S()}, "required": ["first", "last"], "additionalProperties": False}}, "required": ["person"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 3, "maxItems": 5},
    {"type": "object", "properties": {"points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"], "additionalProperties": False}, "minItems": 1, "maxItems": 3}}, "required": ["points"], "additionalProperties": False},
    {"type": "object", "properties": {"title": S(30), "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "genre": {"enum": ["drama", "comedy", "horror"]}}, "required": ["title", "year", "genre"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}, "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "items": S(20), "minItems": 1, "maxItems": 3}, "done": {"type": "boolean"}}, "required": ["steps", "done"], "additionalProperties": False},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"const": "C"}}, "required": ["temperature", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}, "confidence": {"enum": ["low", "high"]}}, "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": S(8)}, "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 50}}, "required": ["id", "qty"], "additionalProperties": False},
    {"type": "object", "properties": {"language": {"enum": ["Python", "Rust", "Go"]}, "reasons": {"type": "array", "items": S(16), "maxItems": 2}}, "required": ["language", "reasons"], "additionalProperties": False},
    {"type": "object", "properties": {"name": S(), "nickname": {"anyOf": [S(10), {"type": "null"}]}}, "required": ["name", "nickname"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}, "required": ["matrix"], "additionalProperties": False},
]
PROMPTS = ["Describe a person.", "Name a city.", "Pick a colour.", "Tag this article about space travel.", "Price a sandwich.",
           "Give a US zip code.", "Is water wet?", "Name a famous scientist.", "Pick three digits.", "Give some points on a grid.",
           "Describe a film.", "Make up an email address.", "How to boil an egg?", "What is the weather in Paris?", "What is 6 times 7?",
           "Nest three objects.", "Order some screws.", "Pick a programming language.", "Name someone and their nickname.", "Write a 2x2 matrix."]
