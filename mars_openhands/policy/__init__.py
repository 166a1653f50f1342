"""Engine-agnostic scheduling decisions (pure functions and small state objects; design.md §1)."""
