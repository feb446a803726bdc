from tpmk.comm.allreduce import CommError, Communicator

__all__ = ["Communicator", "CommError"]
