"""The code task family: problems, data sets, the host-side grader and the scripts it ships into
the sandbox (sandbox_scripts/)."""
