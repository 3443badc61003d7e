"""The repository task family: a coding agent fixes a generated repository in a sandbox session."""
