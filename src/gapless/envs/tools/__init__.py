"""The tool-use task family: multi-turn episodes with tools run in a sandbox session."""
