"""``python -m course_utils.plan``: the planner against public runs and published throughput."""

from .published import public_runs_table

print(public_runs_table())
