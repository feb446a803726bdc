from tpmk.launcher.launch import (LAUNCHERS, add_runtime_args, default_launcher, launch,
                                  resolve_model, runtime_from_args)

__all__ = ["LAUNCHERS", "add_runtime_args", "default_launcher", "launch", "resolve_model",
           "runtime_from_args"]
