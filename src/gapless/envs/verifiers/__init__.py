"""Prime Intellect's verifiers environments behind the Environment protocol."""
