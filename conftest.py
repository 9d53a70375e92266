"""The repository's pytest set-up: nbval runs each notebook with its student copy checked alongside."""

pytest_plugins = ["course_utils.tooling.nbval_student"]
