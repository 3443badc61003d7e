"""The agent task family: an external agent program talks to the policy through the gateway."""
