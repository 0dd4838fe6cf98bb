"""What a run's rows say: robust statistics, fits, claims, the verdict, capacity, roofline."""
