"""Reproduction: nemo_rl.utils.checkpoint_engines (7ea279a)."""
