"""The OpenAI-compatible HTTP server: `build_app` (server.py), the flags (cli_args.py), `main` (api_server.py)."""
