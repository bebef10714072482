"""`peagle bench`: datasets, offline runner, sweep, report and plots (see cli.py)."""
