"""Reproduction: nemo_rl.utils (7ea279a)."""
