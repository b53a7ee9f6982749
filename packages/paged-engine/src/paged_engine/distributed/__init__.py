"""Scale-out on torch.distributed: process groups, collectives, the launch of worker ranks."""
