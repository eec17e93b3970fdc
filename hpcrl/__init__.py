"""hpcrl: RL post-training on batch systems with walltimes."""

__version__ = "0.1.0"
