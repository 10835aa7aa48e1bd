import { defineConfig } from "vitest/config";
import react from "@vitejs/plugin-react";

// Tauri serves the built files from its own origin root, so the default base "/" is right.
export default defineConfig({
  plugins: [react()],
  clearScreen: false,
  server: {
    port: 1420,
    strictPort: true,
  },
  build: {
    outDir: "dist",
    target: "safari16",
    emptyOutDir: true,
    // A desktop app loads its bundle from disk; one chunk is fine.
    chunkSizeWarningLimit: 2000,
  },
  test: {
    include: ["src/**/*.test.{ts,tsx}"],
    environment: "node",
  },
});
