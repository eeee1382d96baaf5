"""An OpenAI-compatible HTTP server around the engine: `extkv serve`."""

from extkv.serving.app import ServerSettings, build_app, run_server

__all__ = ["ServerSettings", "build_app", "run_server"]
