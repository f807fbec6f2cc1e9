from phalanx.config.loader import load_config
from phalanx.config.schema import Config

__all__ = ["Config", "load_config"]
