"""SWE tasks: coding-agent episodes over real repositories, graded by their own tests."""
