"""The Teacher Manager: teacher models served by engines (Ray actors), scoring the student's samples
for on-policy distillation, with only a byte budget of them resident at a time."""
