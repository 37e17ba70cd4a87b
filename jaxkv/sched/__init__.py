"""sched: requests, the block manager with prefix caching, the scheduler."""
