"""Reproduction of NeMo RL's checkpoint-engine contract (NVIDIA-NeMo/RL @ 7ea279a); see README.md."""
