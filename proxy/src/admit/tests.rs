//! Admission tests under paused tokio time: fairness, cost, budgets, refusals, reload.
