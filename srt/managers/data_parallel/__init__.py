"""The data-parallel controller process and its pure parts: routing policy, reply merging
across ranks, and the controller's metrics families."""
