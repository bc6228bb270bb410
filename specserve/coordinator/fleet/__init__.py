"""The worker fleet: the replicas of both tiers, how a session's calls reach them, and what happens when one fails."""
