"""The Tinker-compatible training service (`gapless serve-training`, docs/service.md)."""
