"""chatgen's OpenAI-compatible server: `build_app(module)` (app.py) and `chatgen serve` (cli.py).
docs/serving.md."""
