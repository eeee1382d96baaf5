"""An OpenAI-compatible HTTP server around the engine: `extkv serve`."""

from extkv.serving.app import build_app, run_server
from extkv.serving.settings import ServerSettings

__all__ = ["ServerSettings", "build_app", "run_server"]
