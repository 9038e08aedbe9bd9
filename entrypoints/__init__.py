"""Entry points above `trainer` and `infra`: code that picks where a job runs and hands it to either."""
