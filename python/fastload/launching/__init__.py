"""Starting fastload's worker processes: spawn, the zygote, the fork server."""
