"""robotft: demonstrations to robot policies on real hardware."""
