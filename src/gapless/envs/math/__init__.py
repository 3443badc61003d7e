"""The math task family: procedural arithmetic and math data sets, graded by answer."""
