"""The Helm chart (``charts/kv-epp``) and the Python that generates and checks it: ``generate.py`` writes the
chart's generated files, ``dashboards.py`` holds the Grafana dashboards, ``chart_variants.py`` the documented
variants and an offline renderer for the tests."""
