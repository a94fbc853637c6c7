-- The language profile a plugin version was uploaded for (rust, js, python): which limits it
-- runs under. Versions stored before profiles existed are Rust-sized.
ALTER TABLE plugins ADD COLUMN runtime TEXT NOT NULL DEFAULT 'rust';
