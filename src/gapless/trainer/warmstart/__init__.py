"""Supervised warm start (SFT) before the RL steps."""
