"""Stand-in for vLLM's argument parser: the standard one."""

from argparse import ArgumentParser as FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
