"""batchfleet's supervisor: watches the fleet through the workers' status records in Redis."""
