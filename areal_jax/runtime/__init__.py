"""The asynchronous runtime: staleness-bounded queue, rollout controller, weight transfer, run loop."""
