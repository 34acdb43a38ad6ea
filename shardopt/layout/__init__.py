"""Layout: where each matrix lives (DTensor placements), a param's matrices, buckets of same-layout matrices."""
