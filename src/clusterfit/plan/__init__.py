"""`clusterfit plan`: how a job would scale on hardware you do not have yet, from a cost model."""
