from tpmk.serve.app import Server, add_serve_parser, run_serve
from tpmk.serve.scheduler import Request, Scheduler

__all__ = ["Server", "add_serve_parser", "run_serve", "Request", "Scheduler"]
