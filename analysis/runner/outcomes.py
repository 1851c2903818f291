"""The outcomes ``tracetap run`` records (no imports: analysis reads INTERRUPTED too)."""

SUCCESS = "success"  # the outcome compare counts as a success by default
FAILURE = "failure"
TIMEOUT = "timeout"  # the harness ran past --timeout: its own failure, reward 0
GRADER_ERROR = "grader_error"  # the grader failed or printed no reward: no reward stored
# An attempt the run did not see to its end (Ctrl-C, a killed runner): it says nothing of
# the harness, so analysis counts it as an infra episode (analysis/episodes.py) and a
# rerun runs its slot again.
INTERRUPTED = "interrupted"
