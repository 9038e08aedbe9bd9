"""Entry points above `trainer` and `infra`: the launcher (picks where a job runs and hands it to either) and
the process mains, thin files over one trainer function each (the learner both launchers start, the
held-out psqa evaluation)."""
