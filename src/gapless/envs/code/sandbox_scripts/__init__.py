"""Scripts that run inside the sandbox. They are read as text by envs/code/environment.py and
shipped into each judged job under the names they import each other by (gapless_judge,
gapless_values, gapless_candidate); the host never imports them as modules."""
