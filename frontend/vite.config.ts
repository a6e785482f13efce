import { defineConfig } from "vitest/config";
import react from "@vitejs/plugin-react";

// The backend (`minivllm serve`, port 8000) serves frontend/dist in production; in development the
// Vite server proxies every backend route to it.
const backend = process.env.MINIVLLM_BACKEND ?? "http://127.0.0.1:8000";

export default defineConfig({
  plugins: [react()],
  server: {
    proxy: {
      "/v1": backend,
      "/api": backend,
      "/health": backend,
      "/metrics": backend,
      "/ws": { target: backend, ws: true },
    },
  },
  build: {
    outDir: "dist",
    sourcemap: true,
    chunkSizeWarningLimit: 800,
  },
  test: {
    include: ["src/**/*.test.{ts,tsx}"],
    environment: "node",
  },
});
