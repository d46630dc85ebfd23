"""Example user jobs for `workload=custom` (see harness/workload.py and the README)."""
