"""pdserve's application layer, above every other package: the ``pdserve`` CLI (``cli``), the
Ray Serve application that wires the router and both pools together (``deploy``; Ray Serve's
``serve deploy`` and KubeRay import ``pdserve_app.deploy:app_builder``) and the deployment
files generated from a cluster.yaml (``render``). Nothing below imports it (docs/design.md,
"Layers")."""
