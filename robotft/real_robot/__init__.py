"""Deployment on hardware without ROS: robot and camera contracts, safety layer, chunk executors, timing."""
