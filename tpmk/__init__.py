from tpmk.config import ModelConfig, RuntimeConfig

__all__ = ["ModelConfig", "RuntimeConfig"]
