"""Native renderers, one module a template family, each byte-equal to the official chat template it names (goldens in
`tests/rendering/goldens/`). `server/rendering/families.py` maps a family to its renderer; any other model goes
through `server/rendering/jinja_renderer.py`."""
