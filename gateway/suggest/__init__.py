"""``gateway suggest``: limits proposed from logged traffic, each number with its evidence,
written as a policy and proved by replaying it on the same logs."""
