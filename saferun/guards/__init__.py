"""Guards: the checks that make a wrong result fail loudly (bad steps, spikes, buffers, eval
purity, DataLoader preflight, anomaly replay, host-sync audit, `saferun check`)."""
