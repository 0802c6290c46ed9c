"""Write jobs and the state every worker shares (SQLite): jobs, shard digests."""
