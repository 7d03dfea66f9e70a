"""Recipe templates: each is one file you can copy (`saferun new DIR --from NAME`) and own."""
